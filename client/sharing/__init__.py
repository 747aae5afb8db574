"""Sharing one host copy between workers: the session that owns a namespace's membership (``session``), what a
creator publishes and how (``share``, ``publish``, ``creator_source``), and a follower's attach (``attach_prefetch``).
Users reach it as ``ft.SharedOffloadSession``."""
