"""shoal.plan"""
