"""End to end: the examples, the documentation's snippets and API reference, the demo and the
``mos-lease`` command, packaging, and the tmux adapter on a real tmux server."""
