"""Data: files -> examples -> packed, shifted, masked batches (dataset.py), and chat templates with
their assistant spans (chat_templates.py)."""
