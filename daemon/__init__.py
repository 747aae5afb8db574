"""``ftd``: the optional per-host namespace daemon of flextensor.

Workers share weights through POSIX shared memory without any daemon; what ``ftd`` adds is speed and
hygiene on a host where processes crash: it watches every registered participant through a pidfd and ends
its lease the moment the process exits (followers of a dead creator fail in milliseconds instead of a lease),
reclaims namespaces whose participants are all gone (no supervisor needed to keep ``/dev/shm`` clean), can
hold a generation's weights across a full restart of the workers, and exposes status, a CLI and Prometheus
metrics.  It reuses ``flextensor.shm`` (journal, lease table, offline cleanup) and never imports torch.
See ``docs/daemon.md``.
"""
