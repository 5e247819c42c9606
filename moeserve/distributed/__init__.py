"""Parallel layout, process groups, launch and expert dispatch."""
