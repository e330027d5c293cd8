"""shoal.net"""
