"""The types both processes share: what the API process sends the engine and what comes back.

msgspec Structs, so the same objects cross the process boundary (msgpack) unchanged. The
engine sees token ids only: no text prompt, template or JSON ever appears here.
"""
