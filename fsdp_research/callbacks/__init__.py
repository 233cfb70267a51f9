"""Callbacks (the `callbacks` config: name -> {_target_, kwargs}): objects with any of the hooks in
fsdp_research.callbacks.hooks.HOOKS, called on every rank. Shipped: spike (loss and gradient-norm spikes, optional
skip-step), grad_norms (per-block gradient norms), ema (a sharded moving average of the weights)."""
