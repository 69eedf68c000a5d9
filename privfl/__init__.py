"""privfl: federated-learning training with exact capture of every transmitted artifact."""
