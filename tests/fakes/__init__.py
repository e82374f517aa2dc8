"""Test doubles for clouds: fault-injecting proxies and fakes (STYLE.md item 13)."""
