"""The offload engine: one model's state (``context``), its phases as handlers (``phase``, ``discovery``,
``profiling``, ``inference``), the switch to a plan (``switch``), the INFERENCE build (``build``), adoption of
saved states (``adoption``), patched forwards (``hooks``), the warm-up's copies (``warmup``), the teardown, and
the indirect runtime of ``profile_mode="torch_function"`` (``function_traps``).

Imports flow one way: discovery -> profiling -> switch / inference -> build -> warmup, hooks, context; the engine
never imports the manager, which owns the current phase handler."""
