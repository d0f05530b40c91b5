"""Offline tuning: prompt groups, the acceptance pass, the pass-cost profile, and the rules that make a preset."""
