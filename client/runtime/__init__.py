"""Torch mechanisms the engine drives and that know nothing of it: the block loader, host-block memory, pinned
staging, timing and trap windows, the transfer sweep, the warm-up loader and DISCOVERY's usage recorder; and the
join of a worker thread that Ctrl-C cannot cut short."""
