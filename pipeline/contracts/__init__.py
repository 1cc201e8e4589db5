"""The contracts every layer shares: the messages between stages, the error types, the
protocols backends implement (optional capabilities declared as protocols of their own), and the
recipe's section types. Depends on msgspec alone; nothing here imports the rest of the project.
"""
