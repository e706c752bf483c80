"""Named experiments. Every module in this package is loaded by the launcher and registers its
configs with ``@register_experiment``; ``python -m titanax.launch --list`` shows them."""
