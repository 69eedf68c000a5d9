"""Development tools of the checkout (not installed with privfl)."""
