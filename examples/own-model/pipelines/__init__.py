"""This project's pipelines (a folder named like raylane's own on purpose: see app/__init__.py)."""
