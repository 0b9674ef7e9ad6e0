"""Model building blocks shared by the architectures in ``octavo.models``."""
