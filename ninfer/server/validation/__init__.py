"""Validation shared by the protocol adapters: field readers and the rules every protocol applies
(tools, cache markers, media, thinking and effort, sampling), written once."""
