"""What a run costs before it starts: per-rank memory, FLOPs, network traffic, start-up bytes, the
step cost model and the layout recommender (`ray-dhp plan`).
"""
