from nanokv.serve.server import main

main()
