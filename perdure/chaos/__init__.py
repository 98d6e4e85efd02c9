"""Fault schedules for the four failure classes, and their injection."""
