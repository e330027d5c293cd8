"""shoal.demo"""
