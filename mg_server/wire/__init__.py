"""What mg's processes share: the messages, the request/reply channel, the K/V slot buffer,
beat files, the fingerprint and the clean-up of an instance's files."""
