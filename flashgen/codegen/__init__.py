"""From a spec and a config to an imported Triton module: plan.py writes the spec's mask and
score modifier as Triton expressions, render.py fills the Jinja templates, cache.py writes the
source into the content-addressed kernel cache and imports it."""
