"""Optimizers, parameter groups, schedules, Muon."""
