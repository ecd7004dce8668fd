"""Training worker and environment actors: multi-turn GRPO episodes (tools, environments on Ray actors)."""
