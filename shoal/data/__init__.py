"""shoal.data"""
