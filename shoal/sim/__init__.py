"""shoal.sim"""
