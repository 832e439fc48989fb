"""The core: ``GradientMonitor`` and what it stands on, in plain PyTorch (no Lightning, no TensorBoard).

``monitor`` chooses the modules, arms and collects; ``planning`` gives each module its read
plan; ``stats`` and ``_kernels`` reduce tensors to statistics and histograms on their device;
``records`` is what the monitor hands back; ``forward_checks`` and ``attention`` the forward
statistics; ``noise`` the gradient noise scale's probe and smoothing; ``sentinel`` the check for
non-finite gradients; ``_shards`` the pieces of sharded parameters; ``_checks`` and ``_text`` the
argument checks and wording every layer uses. The public names are importable from
``lightning_gradhooks``.
"""
