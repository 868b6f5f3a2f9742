"""Self-checks of the substrate (`tierplan check ...`): random traffic, every byte verified."""
