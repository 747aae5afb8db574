"""Host memory at pinned speed. Two ways to get there: page-lock the memory where it lies (``in_place``, the
warm-up's sources), or copy through a small ring of pinned bounce buffers without registering anything
(``bounce_copy``, which hands each chunk to the device through ``bounce_chunks``). ``launch_turns`` keeps the
page-locking threads from stalling the warm-up's launches."""
