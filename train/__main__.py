from train.main import main

main()
