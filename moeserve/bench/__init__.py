"""Benchmark clients for a running moeserve (or any OpenAI-compatible) server."""
