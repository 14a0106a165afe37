"""A run's life around the loop: its folder (folder.py), what a resume may change
(resume_settings.py), metrics (metrics.py) and Ctrl-C (interrupts.py)."""
