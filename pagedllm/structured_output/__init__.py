"""Structured outputs: grammars compiled from a request's constraint, and the token bitmask that
keeps each step's sample inside them (llguidance; see grammar.py for why not xgrammar)."""
