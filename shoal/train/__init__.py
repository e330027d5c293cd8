"""shoal.train"""
