"""The shell: the Lightning callback ``GradHooks`` (``callback``), what one fit holds (``_fit``) and
what only a Trainer knows (``_trainer``). It decides *when*; the core and the log do *what*.
``from lightning_gradhooks import GradHooks`` (``pytorch_lightning``) and
``from lightning_gradhooks.lightning import GradHooks`` (``lightning.pytorch``) as before.
"""
