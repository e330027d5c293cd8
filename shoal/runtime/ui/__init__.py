"""What a person watches: the live dashboard, `shoal status` tables and the step statistics they show."""
