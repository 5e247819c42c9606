"""Parallel layout, process groups, collectives of plain objects and expert dispatch.

Below the layers (they import it); starting the ranks is ``moeserve.launch``, above the engine.
"""
