"""A ``transformers`` causal LM (GPT-2 architecture, random init) as a perdure task."""
