"""Jinja2 templates of emitted programs: one per program section, one macro file per op family (ops/)."""
