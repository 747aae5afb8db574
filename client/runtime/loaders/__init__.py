"""The loaders that put offloaded weights on the compute device. INFERENCE streams host blocks through rotating
device slots (``block_loader``) or through byte ranges of one device arena (``arena_loader``); the DISCOVERY and
PROFILING passes get every trap's weights from ``warm_loader``."""
