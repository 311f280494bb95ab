"""Helpers shared by the tests: processes, scraping, private servers."""
