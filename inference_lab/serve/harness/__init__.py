"""The test harness: fault injection, scripted responses, engine commands."""
