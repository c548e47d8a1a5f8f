"""What to run: recipes and profiles made into a validated plan (recipes.py; the YAML lives in flows/recipes/ and
flows/profiles/), and what a plan's node returns when it ran (results.py). Imports nothing else of flows/."""
