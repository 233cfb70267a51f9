"""The planner and the doctor."""
