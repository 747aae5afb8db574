"""The pure-Python planner: the cost model (``plan_model``), the strategies, and the diagnostics tables."""
