"""Small dataset files shipped with the package, and the code that writes them."""
