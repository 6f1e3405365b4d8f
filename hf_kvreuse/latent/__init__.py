"""LatentRemedy: the latent bridge, its distillation trainer (``python -m hf_kvreuse.latent.train``) and
shipped checkpoints. The cache is :class:`hf_kvreuse.LatentRemedyCache`."""

from .bridge import LatentBridge, LatentBridgeMismatchError

__all__ = ["LatentBridge", "LatentBridgeMismatchError"]
