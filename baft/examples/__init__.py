"""Example models that baft can profile and train without a user script."""
