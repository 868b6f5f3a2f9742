"""Decision service (step 3): predictors and optimizer. Pure Python; never imports torch, agent or runtime."""
