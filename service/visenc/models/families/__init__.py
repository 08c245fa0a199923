"""The served model families, one module each: a module's ``FAMILIES`` registers it
(``visenc.models.registry``); nothing else does."""
