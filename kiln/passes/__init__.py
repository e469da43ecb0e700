"""Graph passes: one per file; ``manager.py`` holds the one ordered list and says where each runs."""
