"""shoal.runtime"""
