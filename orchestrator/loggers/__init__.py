"""Where step metrics go: W&B (online or offline), nowhere, and the run directory."""
