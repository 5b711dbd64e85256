"""Memory planning, on metadata before a weight byte is read: a checkpoint's weights by stage
(weight_layout.py), what a model needs (footprint.py), the sizes a plan chooses or why it
refuses (plan.py), the ways out of a refusal (advice.py, advice_text.py, decode_speed.py), each
weight format's cost (weight_formats.py) and a rank's own check where it runs (rank_plan.py).
It sits below the engine, the executors and the workers, which all plan with it."""
